// A pasted document in a user's message: its name and size as a chip at the right of the column;
// a click shows its text below (scrollable), another hides it.
import QtQuick
import QtQuick.Controls
import QtQuick.Controls.impl

Column {
    id: attachment
    required property var modelData
    property bool expanded: false
    objectName: "attachment"
    spacing: 6

    Rectangle {
        id: chipBox
        objectName: "attachmentChip"
        property string label: attachment.modelData.name
        property string size: attachment.modelData.size
        anchors.right: parent.right
        width: Math.min(chipRow.implicitWidth + 24, attachment.width * 0.85)
        height: 40
        radius: 12
        color: chipArea.containsMouse ? theme.colours.hover : theme.colours.userBubble
        border.color: theme.colours.border
        Row {
            id: chipRow
            anchors.verticalCenter: parent.verticalCenter
            x: 12
            spacing: 8
            IconImage {  // an icon of the app's set: an emoji showed as an empty box without an emoji font
                source: iconDir + "/document.svg"
                sourceSize.width: 18
                sourceSize.height: 18
                color: theme.colours.muted
                anchors.verticalCenter: parent.verticalCenter
            }
            Column {
                Text {
                    text: attachment.modelData.name
                    color: theme.colours.text
                    font.pixelSize: 13
                    font.bold: true
                    elide: Text.ElideRight
                    width: Math.min(implicitWidth, attachment.width * 0.85 - 80)
                }
                Text { text: attachment.modelData.size; color: theme.colours.muted; font.pixelSize: 11 }
            }
            Text {
                text: attachment.expanded ? "▴" : "▾"
                color: theme.colours.muted
                font.pixelSize: 14
                anchors.verticalCenter: parent.verticalCenter
            }
        }
        MouseArea {
            id: chipArea
            anchors.fill: parent
            hoverEnabled: true
            cursorShape: Qt.PointingHandCursor
            onClicked: attachment.expanded = !attachment.expanded
        }
        ToolTip.visible: chipArea.containsMouse
        ToolTip.text: attachment.modelData.tip
        ToolTip.delay: 400
    }

    Rectangle {
        visible: attachment.expanded
        width: parent.width
        height: visible ? Math.min(320, body.implicitHeight + 20) : 0
        radius: 10
        color: theme.colours.codeBg
        border.color: theme.colours.border
        Flickable {
            anchors.fill: parent
            anchors.margins: 10
            contentHeight: body.implicitHeight
            clip: true
            boundsBehavior: Flickable.StopAtBounds
            ScrollBar.vertical: ScrollBar { policy: ScrollBar.AsNeeded }
            TextEdit {
                id: body
                objectName: "attachmentText"
                property string plain: attachment.expanded ? attachment.modelData.text : ""
                width: parent.width - 12
                text: attachment.expanded ? attachment.modelData.text : ""  // laid out only when shown
                textFormat: TextEdit.PlainText
                wrapMode: TextEdit.Wrap
                readOnly: true
                selectByMouse: true
                color: theme.colours.text
                font.pixelSize: 13
            }
        }
    }
}
