// A fenced code block: its language, a copy button, the highlighted code.
import QtQuick
import QtQuick.Controls

Rectangle {
    id: box
    property string language
    property string code
    property string html
    objectName: "codeBlock"
    height: header.height + codeText.height + 20
    radius: 10
    color: theme.colours.codeBg
    border.color: theme.colours.border

    Rectangle {
        id: header
        width: parent.width
        height: 32
        radius: 10
        color: theme.colours.codeHeader
        Rectangle { width: parent.width; height: 10; anchors.bottom: parent.bottom; color: parent.color }
        Text {
            objectName: "codeLanguage"
            text: box.language || "code"
            color: theme.colours.muted
            font.pixelSize: 12
            anchors.left: parent.left
            anchors.leftMargin: 12
            anchors.verticalCenter: parent.verticalCenter
        }
        ToolButton {
            id: copy
            objectName: "copyCode"
            property bool done: false
            anchors.right: parent.right
            anchors.verticalCenter: parent.verticalCenter
            height: 28
            text: done ? "Copied" : "Copy"
            icon.source: iconDir + (done ? "/check.svg" : "/copy.svg")
            icon.width: 14
            icon.height: 14
            icon.color: theme.colours.muted
            palette.buttonText: theme.colours.muted
            font.pixelSize: 12
            onClicked: { chat.copyText(box.code); done = true; reset.restart() }
            Timer { id: reset; interval: 1500; onTriggered: copy.done = false }
        }
    }

    TextEdit {
        id: codeText
        objectName: "codeText"
        property string plain: box.code
        x: 12
        y: header.height + 10
        width: parent.width - 24
        text: box.html
        textFormat: TextEdit.RichText
        wrapMode: TextEdit.Wrap  // at word boundaries; a word longer than the line still breaks
        readOnly: true
        selectByMouse: true
        color: theme.colours.text
        font.family: "monospace"
        font.pixelSize: 13
    }
}
