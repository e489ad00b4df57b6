// A chat with no messages yet: what to ask, one click away.
import QtQuick
import QtQuick.Controls

Item {
    id: empty
    readonly property var prompts: [
        ["Explain a concept", "Explain how a hash map works, with a short example."],
        ["Write some code", "Write a Python function that checks whether a string is a palindrome."],
        ["Plan something", "Plan a relaxed three-day trip to Lisbon."],
        ["Polish a text", "Make this sentence clearer: the meeting which was planned got moved to later."]
    ]

    Column {
        anchors.centerIn: parent
        width: Math.min(640, empty.width - 48)
        spacing: 18

        Image {
            source: assetDir + "/kvchat.svg"
            sourceSize.width: 56
            sourceSize.height: 56
            anchors.horizontalCenter: parent.horizontalCenter
        }
        Text {
            objectName: "emptyTitle"
            text: "What can I help with?"
            color: theme.colours.text
            font.pixelSize: 26
            font.bold: true
            anchors.horizontalCenter: parent.horizontalCenter
        }
        Text {
            objectName: "whereNote"
            text: chat ? chat.where : ""
            color: theme.colours.muted
            font.pixelSize: 14
            anchors.horizontalCenter: parent.horizontalCenter
        }
        Grid {
            columns: 2
            spacing: 10
            width: parent.width
            Repeater {
                model: empty.prompts
                delegate: Rectangle {
                    required property var modelData
                    objectName: "examplePrompt"
                    property string prompt: modelData[1]
                    width: (empty.width > 0 ? Math.min(640, empty.width - 48) : 640) / 2 - 5
                    height: 72
                    radius: 12
                    color: area.containsMouse ? theme.colours.hover : theme.colours.panel
                    border.color: theme.colours.border
                    Column {
                        anchors.fill: parent
                        anchors.margins: 12
                        spacing: 4
                        Text { text: modelData[0]; color: theme.colours.text; font.bold: true; font.pixelSize: 13 }
                        Text {
                            text: modelData[1]
                            color: theme.colours.muted
                            font.pixelSize: 12
                            width: parent.width
                            elide: Text.ElideRight
                        }
                    }
                    MouseArea {
                        id: area
                        anchors.fill: parent
                        hoverEnabled: true
                        cursorShape: Qt.PointingHandCursor
                        onClicked: chat.usePrompt(parent.prompt)
                    }
                }
            }
        }
    }
}
